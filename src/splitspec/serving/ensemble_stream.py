"""Streaming requests to the served ensemble over Triton's gRPC stream (``tritonclient.grpc.aio``), for the
OpenAI-compatible front end (:mod:`splitspec.serving.openai_api`): one request per call, inputs built by
:func:`splitspec.serving.client.grpc_inputs`, each response's outputs yielded as they come, failures as
:class:`~splitspec.serving.openai_errors.APIError`."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from splitspec.serving import openai_errors as api_errors
from splitspec.serving.client import grpc_inputs, is_final, result_dict


class EnsembleStream:
    """Streaming requests to the ensemble over one gRPC channel (opened on first use, in the serving event loop)."""

    def __init__(self, address: str, model: str = "ensemble"):
        self.address, self.model, self._client = address, model, None

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def stream(self, text: str, max_tokens: int, params: dict) -> AsyncIterator[dict]:
        """Send one request and yield each response's outputs (:func:`~splitspec.serving.client.result_dict`) until
        the final one. Closing or cancelling the generator early cancels the gRPC stream, hence the request.

        Raises:
            APIError: the ensemble answered with an error (:func:`~splitspec.serving.openai_errors.ensemble_error`),
                or the server cannot be reached (503).
        """
        import grpc
        import tritonclient.grpc.aio as grpcaio
        from tritonclient.utils import InferenceServerException

        inputs = grpc_inputs(text, max_tokens, **params)
        if self._client is None:
            self._client = grpcaio.InferenceServerClient(self.address)
        sent = asyncio.Event()

        async def request_stream():  # one request; the stream stays open until the answer is complete
            yield {"model_name": self.model, "inputs": inputs,
                   "parameters": {"triton_enable_empty_final_response": True}}
            await sent.wait()

        call = self._client.stream_infer(request_stream())
        finished = False
        try:
            async for result, error in call:
                if error is not None:
                    finished = True
                    raise api_errors.ensemble_error(error.message() if hasattr(error, "message") else str(error))
                ev, final = result_dict(result), is_final(result)
                if ev:
                    yield ev
                if final:
                    finished = True
                    return
            finished = True
            raise api_errors.unavailable("the gRPC stream ended before the final response")
        except grpc.RpcError as e:
            finished = True
            details = e.details() if hasattr(e, "details") else str(e)
            raise api_errors.unavailable(f"grpc {self.address}: {details}") from None
        except InferenceServerException as e:
            finished = True
            raise api_errors.unavailable(f"grpc {self.address}: {e.message()}") from None
        finally:
            sent.set()
            if not finished:
                call.cancel()
