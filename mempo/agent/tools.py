"""The agent's tools over a `Retriever`: `<search>` and `<access>` -> `<information>` blocks.

    env = ToolEnv(retriever, tokenizer, ToolConfig(topk=3, observation_max_tokens=512))
    obs = await env.search("Gaki Baizound born")              # "<information> Doc 1(...) ... </information>"
    reader = ArticleReader()                                   # one per episode
    obs, short = await env.access("Quaevzawick", reader)       # first chunk; again -> next chunk

Access follows ASearcher: the whole article (all passages with the title) is split into
chunks of `access_chunk_chars` characters; each call shows the next chunk, and once the
turn is no longer the last one the context keeps only the first `short_text_chars`
characters of each chunk (`short` above).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mempo.agent.format import format_observation
from mempo.retrieval.base import Retriever, format_passages


@dataclass(frozen=True)
class ToolConfig:
    """Tool settings: `ToolConfig.from_params(rollout)` from the `rollout:` params (the defaults
    agree with `RolloutParams`; tests/test_config_rollout.py checks it).

    Attributes:
        topk: passages per search.
        observation_max_tokens: tool results are cut to this many tokens of the policy's
            tokenizer before they enter a prompt.
        access_chunk_chars: characters per chunk of an accessed article.
        short_text_chars: characters kept of each chunk once the access is not the last turn.
    """

    topk: int = 3
    observation_max_tokens: int = 512
    access_chunk_chars: int = 1000
    short_text_chars: int = 100

    @classmethod
    def from_params(cls, p: Any) -> ToolConfig:
        """From a `RolloutParams` (or anything with these attributes)."""
        return cls(topk=p.topk, observation_max_tokens=p.observation_max_tokens,
                   access_chunk_chars=p.access_chunk_chars, short_text_chars=p.short_text_chars)


@dataclass
class ArticleReader:
    """Per-episode access state: the next chunk to show for each article title."""

    next_chunk: dict[str, int] = field(default_factory=dict)


def chunk_text(text: str, size: int) -> list[str]:
    """Split `text` into chunks of at most `size` characters, at whitespace when possible."""
    text = text.strip()
    if size <= 0 or len(text) <= size:
        return [text] if text else []
    chunks: list[str] = []
    while text:
        if len(text) <= size:
            chunks.append(text)
            break
        cut = text.rfind(" ", 0, size + 1)
        cut = cut if cut > size // 2 else size
        chunks.append(text[:cut].strip())
        text = text[cut:].strip()
    return chunks


class ToolEnv:
    """Runs `<search>` / `<access>` actions against a retriever (async, many episodes at once)."""

    def __init__(self, retriever: Retriever, tokenizer: Any | None = None, config: ToolConfig | None = None) -> None:
        self.retriever = retriever
        self.tokenizer = tokenizer
        self.config = config or ToolConfig()

    def _observe(self, body: str) -> str:
        return format_observation(body, self.tokenizer, self.config.observation_max_tokens)

    async def search(self, query: str) -> str:
        """Top-k passages for `query` as one `<information>` block (cut to the token budget)."""
        hits = (await self.retriever.asearch([query], self.config.topk))[0]
        if not hits:
            return self._observe("No results.")
        return self._observe(format_passages(hits))

    async def access(self, target: str, reader: ArticleReader) -> tuple[str, str]:
        """Open the article `target` names (a doc id, else a title); show its next chunk.

        Returns (observation, short observation).
        """
        target = target.strip()
        passages = (await self.retriever.aaccess(ids=[target]))[0]
        if not passages:
            passages = (await self.retriever.aaccess(titles=[target]))[0]
        if not passages:
            obs = self._observe(f"No article found for '{target}'.")
            return obs, obs
        title = passages[0].title
        chunks = chunk_text(" ".join(p.text for p in passages), self.config.access_chunk_chars) or [""]
        k = min(reader.next_chunk.get(title, 0), len(chunks) - 1)
        reader.next_chunk[title] = k + 1
        head = f"Doc(Title: {title}) [chunk {k + 1}/{len(chunks)}]"
        obs = self._observe(f"{head} {chunks[k]}")
        n = self.config.short_text_chars
        short_body = " ".join(f"[{i + 1}] {c[:n]}{'...' if len(c) > n else ''}" for i, c in enumerate(chunks))
        short = self._observe(f"Doc(Title: {title}) {short_body}")
        return obs, short
