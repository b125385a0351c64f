"""The step loop, the engine API, detokenization and the conversations API."""

from segkv.engine.conversation import Conversation, ConversationSnapshot, Turn
from segkv.engine.llm import LLM

__all__ = ["LLM", "Conversation", "ConversationSnapshot", "Turn"]
