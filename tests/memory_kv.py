"""The coordination service's key-value interface (noloco_jax/asynchronous/control.py) over a dict, for
tests that run the asynchronous protocol on threads in one process."""

import threading
import time


class MemoryKV:
  """The KV interface over a dict: linearisable (one lock), `wait` blocks on a condition variable."""

  def __init__(self):
    self._data: dict[str, str] = {}
    self._cv = threading.Condition()

  def set(self, key: str, value: str) -> None:
    with self._cv:
      self._data[key] = value
      self._cv.notify_all()

  def create(self, key: str, value: str) -> bool:
    with self._cv:
      if key in self._data:
        return False
      self._data[key] = value
      self._cv.notify_all()
      return True

  def get(self, key: str) -> str | None:
    with self._cv:
      return self._data.get(key)

  def wait(self, key: str, timeout_s: float) -> str | None:
    end = time.monotonic() + max(timeout_s, 0.0)
    with self._cv:
      while key not in self._data:
        left = end - time.monotonic()
        if left <= 0:
          return None
        self._cv.wait(left)
      return self._data[key]

  def increment(self, key: str, by: int) -> int:
    with self._cv:
      value = int(self._data.get(key, "0")) + by
      self._data[key] = str(value)
      self._cv.notify_all()
      return value

  def dir(self, prefix: str) -> dict[str, str]:
    with self._cv:
      return {k: v for k, v in self._data.items() if k.startswith(prefix)}

  def delete(self, key: str) -> None:
    with self._cv:
      self._data.pop(key, None)
