"""The step loop and the engine API; conversations and sessions (segkv.sessions) re-exported."""

from segkv.engine.async_engine import AsyncEngine, StreamUpdate
from segkv.engine.core import EngineCore, EngineRequest, EngineStopped, QueueFullError
from segkv.engine.llm import LLM
from segkv.scheduler.scheduler import SchedulerConfig
from segkv.sessions.conversation import Conversation, ConversationSnapshot, Turn
from segkv.sessions.store import Session, SessionStore

__all__ = [
    "LLM",
    "AsyncEngine",
    "Conversation",
    "ConversationSnapshot",
    "EngineCore",
    "EngineRequest",
    "EngineStopped",
    "QueueFullError",
    "SchedulerConfig",
    "Session",
    "SessionStore",
    "StreamUpdate",
    "Turn",
]
