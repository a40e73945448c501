"""tierflow.tiers"""
