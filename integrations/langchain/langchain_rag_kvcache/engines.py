"""`EngineBacked`: how a component reaches a rag-kvcache engine, the fields the retriever and the grader share."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator
from typing_extensions import Self

from rag_kvcache import EngineHandle, ServingEngine


class EngineBacked(BaseModel):
    """An opened `ServingEngine` given (shared, its owner closes it), or an index folder whose engine the component opens
    on first use and closes with `close()`. Listed after a component's LangChain base (`class R(BaseRetriever,
    EngineBacked)`): pydantic merges the bases' configs in order, so this one's `extra="forbid"` stands."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    engine: ServingEngine | None = Field(
        default=None, exclude=True, description="An opened `ServingEngine`, shared with other components."
    )
    index: str | None = Field(default=None, description="Or the folder of a rag-kvcache index (opened on first use).")
    device: str | None = Field(default=None, description="Torch device of the model (None: the index's, cpu).")
    dtype: str | None = Field(default=None, description="Model dtype (None: the one the index was built with).")

    _handle: EngineHandle = PrivateAttr()

    @model_validator(mode="after")
    def _open_handle(self) -> Self:
        self._handle = EngineHandle(self.engine, self.index, self.device, self.dtype)
        return self

    def close(self) -> None:
        """Close the engine this component opened for `index` (a given `engine` is its owner's to close)."""
        self._handle.close()
