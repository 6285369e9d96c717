"""A run: the core stream (rows -> prompts -> engine -> records), its start-up, the pipeline into
shards, the online feed, preflight and dry-run estimate, the text report, and Ray scale-out."""
