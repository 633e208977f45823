"""Who may send requests: API keys from their source (a file, reloaded on change, or a
Kubernetes Secret, read again every 30 s), per-key rate limits and per-key caps on requests
open at once. The parsing, the key store and the token buckets are pure
(`fleetllm.router.auth`); this module runs them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

from fleetllm.router.auth import ApiKey, KeyStore, RateLimiter, bearer_token, parse_keys
from fleetllm.router.discovery import file_signature
from fleetllm.router.errors import RouterError

log = logging.getLogger("fleetllm.router")

KeysLoader = Callable[[], Awaitable[list[ApiKey]]]
FILE_POLL_SECONDS = 1.0
SECRET_POLL_SECONDS = 30.0


class Access:
    def __init__(
        self,
        *,
        keys_file: Path | None = None,
        keys_loader: KeysLoader | None = None,
        default_rpm: int | None = None,
        default_tpm: int | None = None,
        default_concurrency: int | None = None,
    ) -> None:
        self.keys = KeyStore()
        self.limiter = RateLimiter()
        self.keys_file = keys_file
        self.keys_loader = keys_loader
        self.default_rpm = default_rpm
        self.default_tpm = default_tpm
        self.default_concurrency = default_concurrency
        self.open: dict[str, int] = {}
        """Requests open now, per key name."""
        self._tasks: list[asyncio.Task[None]] = []
        if keys_file is not None:
            self._load_keys_file()

    def start(self) -> None:
        if self.keys_file is not None:
            self._tasks.append(asyncio.create_task(self._watch_keys_file()))
        if self.keys_loader is not None:
            self._tasks.append(asyncio.create_task(self._poll_keys_loader()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- requests ----------------------------------------------------------------------------

    def authenticate(self, authorization: str | None) -> ApiKey | None:
        """The key of a request (None when no key source is configured); raises 401."""
        if not self.keys.enabled:
            return None
        key = self.keys.authenticate(bearer_token(authorization))
        if key is None:
            raise RouterError(401, "Incorrect or missing API key.")
        return key

    @contextlib.contextmanager
    def admitted(self, key: ApiKey) -> Iterator[None]:
        """Hold one of the key's concurrent requests and take one request from its budget,
        for the duration of the block; raises 429 when either is used up."""
        open_now = self.open.get(key.name, 0)
        if key.max_concurrent is not None and open_now >= key.max_concurrent:
            raise RouterError(
                429,
                f"API key {key.name} has {open_now} requests open, its limit; "
                "try again when one has finished.",
                headers={"Retry-After": "1"},
            )
        wait = self.limiter.admit(key, time.monotonic())
        if wait is not None:
            raise RouterError(
                429,
                f"Rate limit reached for API key {key.name}; try again later.",
                headers={"Retry-After": str(max(1, math.ceil(wait)))},
            )
        self.open[key.name] = open_now + 1
        try:
            yield
        finally:
            left = self.open[key.name] - 1
            if left:
                self.open[key.name] = left
            else:
                del self.open[key.name]

    def charge_tokens(self, key: ApiKey, tokens: int) -> None:
        self.limiter.charge_tokens(key, tokens, time.monotonic())

    # -- key sources -------------------------------------------------------------------------

    def _load_keys_file(self) -> None:
        assert self.keys_file is not None
        try:
            text = self.keys_file.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.keys_file}: no such file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{self.keys_file}: cannot read: {exc}") from None
        keys = parse_keys(
            text, self.default_rpm, self.default_tpm, str(self.keys_file), self.default_concurrency
        )
        self.keys.replace(keys)

    async def _watch_keys_file(self) -> None:
        assert self.keys_file is not None
        signature = file_signature(self.keys_file)
        while True:
            await asyncio.sleep(FILE_POLL_SECONDS)
            current = file_signature(self.keys_file)
            if current == signature:
                continue
            signature = current
            try:
                await asyncio.to_thread(self._load_keys_file)
                log.info("API keys reloaded: %d keys", len(self.keys))
            except (ValueError, FileNotFoundError) as exc:
                log.error("API keys file rejected, keeping the last good keys: %s", exc)

    async def _poll_keys_loader(self) -> None:
        """Until the first read succeeds, no key is accepted."""
        assert self.keys_loader is not None
        self.keys.replace([])
        while True:
            try:
                self.keys.replace(await self.keys_loader())
            except Exception as exc:
                log.error("API keys could not be read, keeping the last good keys: %s", exc)
            await asyncio.sleep(SECRET_POLL_SECONDS)
