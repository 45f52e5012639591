"""The fault-injection suite (``pytest -m faults -s`` prints one FAULTS line per scenario)."""
