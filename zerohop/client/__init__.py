"""zerohop's direct multi-replica client (in progress): replica state, health and choice.

Discovery, failover and the SDK transports come next; see the client issue.
"""
