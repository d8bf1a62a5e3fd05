"""The capture stage: a host pool (mapped once, or sized to the state at the first save), and copy threads that fill its slots lazily."""

from tierckpt.capture.copier import Copier
from tierckpt.capture.pool import HostPool

__all__ = ["Copier", "HostPool"]
