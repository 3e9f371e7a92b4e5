"""Supervision: start, watch and restart actors; the address book that keeps their names stable."""
