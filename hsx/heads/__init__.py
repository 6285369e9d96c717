"""Draft heads and their layer-id rules: which boundaries a head's ids name for each engine, loading,
checking and converting heads. Imported by the engines and the exports; imports neither."""
