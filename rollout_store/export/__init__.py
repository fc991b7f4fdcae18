"""What leaves a graph: the export document, the JSONL trace, its checks and figures, and
training rows (per path and tree-packed, JSONL or Parquet).
"""
