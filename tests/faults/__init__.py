"""The fault-injection suite: one FAULTS line of figures per scenario, repeated at the end of every run."""
