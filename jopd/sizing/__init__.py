"""`jopd aot`: one OPD step compiled ahead of time for a device topology, its memory per device and, for a TPU
chip, its predicted time (the roofline)."""
