"""Keys: who a request is from (Identity, Tenant, Limits), how a key is checked (auth, signed
tokens, the operator's signing keys, revocation), and the fleet's key feed. Imports nothing
else of zerohop.
"""
