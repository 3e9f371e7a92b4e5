"""Supervision: start, watch and restart actors; the address book; the ledger."""
