"""tierflow.policies"""
