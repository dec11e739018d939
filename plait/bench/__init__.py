"""Measurements of this machine: the collectives benchmark and the calibration that feeds
the time model. They run inside a job of ranks and talk through plait/runtime only."""
