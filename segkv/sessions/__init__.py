"""Conversations, server-side sessions and conversation snapshot files."""

from segkv.sessions.conversation import Conversation, ConversationEngine, ConversationSnapshot, Turn
from segkv.sessions.store import Session, SessionEngine, SessionStore, SessionTurn

__all__ = [
    "Conversation",
    "ConversationEngine",
    "ConversationSnapshot",
    "Session",
    "SessionEngine",
    "SessionStore",
    "SessionTurn",
    "Turn",
]
