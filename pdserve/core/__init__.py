"""What every part shares and nothing else: the request and worker types, the KV
handle, block hashing, the cluster secret and gRPC security, logging, the model and
the machine's facts, free ports, and the one process mechanism and version lookup.

The bottom layer: it imports no other pdserve package.
"""
