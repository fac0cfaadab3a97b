"""HTTP dialects over the one turn runner: chat completions, responses, completions.

Each module turns its OpenAI request into a typed call (``serve.turn_types``) and formats the
runner's events as that dialect's answer or stream; ``common`` holds what they share (the rollout
headers, the one ``tool_choice`` path, SSE framing).
"""
