"""The knowledge library's calls of kvgraft.Client: add, list and remove entries, and ask.

An entry is a verified solution the daemon keeps as a trusted context
(kvgraftd.library); `ask` recalls an entry's answer or generates with the
library grafted in. Calls that compute (library_add, ask) take the compute
deadline (`compute_timeout_s`); the others the store's (`timeout_s`).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvgraft.client.connection import COMPUTE, Connected
from kvgraft.results import AskResult
from kvgraft.v1 import kvgraft_pb2 as pb


class LibraryCalls(Connected):
    def library_add(
        self,
        problem: str,
        solution: str,
        answer: str,
        *,
        verified_by: str = "",
        tags: Iterable[str] = (),
    ) -> pb.LibraryAddResponse:
        """Deposit a verified solution; an identical entry is reported as already present."""
        request = pb.LibraryAddRequest(
            problem=problem,
            solution=solution,
            answer=answer,
            verified_by=verified_by,
            tags=list(tags),
        )
        return self._unary(self._stub.LibraryAdd, request, COMPUTE)

    def library_list(self, tag: str = "") -> list[pb.LibraryEntry]:
        """The served model's library entries (of one tag), ordered by id."""
        return list(self._unary(self._stub.LibraryList, pb.LibraryListRequest(tag=tag)).entries)

    def library_remove(self, artifact_id: str) -> pb.LibraryRemoveResponse:
        """Remove one library entry (id or unique prefix); other artifacts are refused."""
        request = pb.LibraryRemoveRequest(artifact_id=artifact_id)
        return self._unary(self._stub.LibraryRemove, request)

    def ask(
        self,
        text: str,
        *,
        max_new_tokens: int = 0,
        library_tag: str = "",
        no_recall: bool = False,
    ) -> AskResult:
        """Answer a problem: recall from the library, or generate (with a tag's library)."""
        request = pb.AskRequest(
            text=text,
            max_new_tokens=max_new_tokens,
            library_tag=library_tag,
            no_recall=no_recall,
        )
        return AskResult.from_proto(self._unary(self._stub.Ask, request, COMPUTE))
