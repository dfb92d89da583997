"""The Anthropic Messages surface: wire shapes (msgspec), thinking, tools, and the handlers that map
them to and from api.conversation. Imports api.conversation, api.http and api.service.
"""
