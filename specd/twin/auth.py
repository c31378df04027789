"""SGLang's API keys (``--api-key``, ``--admin-api-key``) as each version checks them.

0.5.4 (srt/utils/common.py add_api_key_middleware, installed only with --api-key): OPTIONS
and paths starting with /health or /metrics pass; every other path, one no route has
included, needs ``Authorization`` to be exactly ``Bearer KEY``.

0.5.11+ (srt/utils/auth.py decide_request_auth, installed when either key is set): the
same exemptions (0.5.20+ also /ready); the scheme ``Bearer`` in any case. A route's level
says which key opens it: NORMAL (every route not marked, and any path no route has) the
api key if there is one, else nothing; ADMIN_OPTIONAL (/freeze_gc among the twin's routes)
the admin key if there is one, else the api key, else nothing. No route is ADMIN_FORCE
(SGLang's http_server notes that its hicache routes check the admin key themselves). No
version reads an ``x-api-key`` header.

Refused: 401 ``{"error":"Unauthorized"}`` (ORJSONResponse), before routing and before
SGLang's HTTP-metrics middleware (the key middleware is added last: the outermost). A
non-ASCII token in 0.5.11+: compare_digest raises TypeError, Starlette's 500.
Multi-tokenizer mode (``--tokenizer-worker-num`` > 1) is not modelled: SGLang installs no
key middleware there and its workers refuse an api key.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

# The twin's routes marked @auth_level(AuthLevel.ADMIN_OPTIONAL) (0.5.11+), by method: a
# route matches only with one of its methods.
ADMIN_OPTIONAL = frozenset({("GET", "/freeze_gc"), ("POST", "/freeze_gc")})
UNAUTHORIZED = b'{"error":"Unauthorized"}'


@dataclass(frozen=True)
class Keys:
    api_key: str | None = None
    admin_api_key: str | None = None

    @classmethod
    def from_words(cls, words: Sequence[str]) -> Keys:
        """The keys among the SGLang flags the twin's parser kept (flag, value; argparse
        takes the last one given)."""
        found: dict[str, str] = {}
        for flag, value in itertools.pairwise(words):
            if flag in ("--api-key", "--admin-api-key"):
                found[flag] = value
        return cls(found.get("--api-key"), found.get("--admin-api-key"))

    def key_for(self, method: str, path: str, *, levels: bool) -> str | None:
        """The key a request to this route must bear (None: it passes without one)."""
        if levels and (method, path) in ADMIN_OPTIONAL:
            return self.admin_api_key or self.api_key or None
        return self.api_key or None

    def warmup_headers(self, *, admin: bool = False) -> dict[str, str]:
        """What SGLang's own warm-up sends: the api key; to an admin route (/freeze_gc)
        the admin key, else the api key."""
        key = (self.admin_api_key or self.api_key) if admin else self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}


def allowed(
    keys: Keys,
    method: str,
    path: str,
    authorization: str | None,
    *,
    exempt: tuple[str, ...],
    levels: bool,
) -> bool:
    """Whether that version's key middleware lets the request through."""
    if method == "OPTIONS" or path.startswith(exempt):
        return True
    key = keys.key_for(method, path, levels=levels)
    if key is None:
        return True
    if not levels:
        # 0.5.4: a plain string comparison.
        return authorization == "Bearer " + key
    if not authorization:
        return False
    parts = authorization.split(" ", 1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return False
    # compare_digest raises TypeError on non-ASCII text: SGLang answers 500 then.
    return secrets.compare_digest(parts[1], key)
