"""tierflow.loader"""
