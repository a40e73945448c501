"""tierflow.pack"""
