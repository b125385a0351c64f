"""The step loop, the engine API, detokenization and the conversations API."""

from segkv.engine.async_engine import AsyncEngine, StreamUpdate
from segkv.engine.conversation import Conversation, ConversationSnapshot, Turn
from segkv.engine.core import EngineCore, EngineRequest, EngineStopped, QueueFullError
from segkv.engine.llm import LLM
from segkv.engine.sessions import Session, SessionStore
from segkv.scheduler.scheduler import SchedulerConfig

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
