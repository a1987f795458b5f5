"""What the learner answers one request with: a typed reply its ZeroMQ loop sends as it is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pydantic import BaseModel


@dataclass(frozen=True)
class Reply:
    """One message back to the requesting peer, and, for a weight chunk, the raw bytes it describes."""

    message: BaseModel
    raw: Optional[memoryview] = None  # sent zero-copy as one more frame after the message
