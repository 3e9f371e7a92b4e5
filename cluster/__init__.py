"""callboard's scheduler on Ray: one queue and one model actor per cluster (issue 17).

Ray is imported only when a cluster is asked for (``pip install 'callboard[ray]'``).
"""
