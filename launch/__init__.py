"""Thin launchers for `python -m trainer.main`: one machine, several workers, TPU VMs."""
