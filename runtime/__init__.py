"""The runtime plumbing the actors stand on.

The I/O loop, the HTTP client and wire parsing, the ledgers and their codec,
and the tables that outlive an actor incarnation.
"""
