from reference.eagle3 import DraftBatch, Eagle3Config, Eagle3Reference

__all__ = ["DraftBatch", "Eagle3Config", "Eagle3Reference"]
