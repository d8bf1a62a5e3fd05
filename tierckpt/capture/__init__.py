"""The capture stage: a host pool allocated once, and copy threads that fill its slots lazily."""

from tierckpt.capture.copier import Copier
from tierckpt.capture.pool import HostPool

__all__ = ["Copier", "HostPool"]
