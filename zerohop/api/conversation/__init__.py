"""The surface-neutral conversation: turns, tools, tool choice, output format, reasoning; one
planner into the engine request and one event stream out of it. Imports api.errors, api.tools,
api.serving (the ServingContext a plan reads) and engine.
"""
