"""Raw ASGI helpers shared by every HTTP surface: bounded bodies, JSON, streaming, disconnects,
the connection guard, rate-limit headers and the error record. Imports api.errors and gateway.
"""
