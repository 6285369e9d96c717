"""Where outputs live: local paths and S3-compatible stores (``store``), the store's lease and the output lock."""
