"""The Anthropic Messages surface: wire shapes (msgspec), thinking, tools, and the handlers that map
them to and from api.conversation. Imports api.errors, api.conversation, api.generation,
api.http, api.serving, api.tools, gateway (its thread store) and the engine's types; no other
surface.
"""
