"""tierflow.format"""
