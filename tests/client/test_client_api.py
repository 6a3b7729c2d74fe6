"""`kvgraft.Client` as a Python user meets it: the address, the deadlines, the options of
generate and graft, the results and their reprs, and its documentation.

Each test guards a defect of issue 31: `Client("host")` went to port 443; compute
calls ignored `timeout_s` and scrub had no deadline at all; an unknown option raised
protobuf's ValueError; `temperature=0` with `greedy=False` sampled at 1.0; results
printed raw bytes and protobuf text; `return_logits` gave bytes; `matched_entry` was
`''` for none; `Client(...)` documented no argument. None of them needs a daemon.
"""

from __future__ import annotations

import hashlib
import inspect
import socket

import numpy as np
import pytest

from kvgraft import AskResult, Client, GenerateResult, Receipt
from kvgraft.client.connection import with_default_port
from kvgraft.client.engine_calls import _generate_options
from kvgraft.errors import DeadlineExceeded
from kvgraft.v1 import kvgraft_pb2 as pb

NOWHERE = "127.0.0.1:1"


def test_an_address_without_a_port_gets_50551(monkeypatch) -> None:
    cases = {
        "localhost": "localhost:50551",
        "kv1.example": "kv1.example:50551",
        "kv1.example:7000": "kv1.example:7000",
        "10.0.0.5": "10.0.0.5:50551",
        "[::1]": "[::1]:50551",
        "[::1]:7000": "[::1]:7000",
        "::1": "[::1]:50551",
        "fe80::1:2": "[fe80::1:2]:50551",
        "unix:/run/kvgraft.sock": "unix:/run/kvgraft.sock",
        "dns:///kv1.example:7000": "dns:///kv1.example:7000",
    }
    assert {address: with_default_port(address) for address in cases} == cases
    assert Client("localhost").address == "localhost:50551"  # no connection is made yet
    monkeypatch.setenv("KVGRAFT_SERVER", "[::1]")
    assert Client().address == "[::1]:50551"


def test_every_call_has_the_deadline_of_its_kind() -> None:
    """Each call waits for the deadline of its kind and names the argument that sets it.
    The peer accepts connections and never answers (the kernel completes the handshake;
    nothing reads), so every call lasts exactly its deadline: a call under the wrong
    one would fail later, naming another argument."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        address = f"127.0.0.1:{silent.getsockname()[1]}"

        def expired(name: str) -> str:
            return (
                f"kvgraftd at {address} did not finish the call within its deadline of "
                f"0.2 s: give it longer with --timeout S (in Python, Client({name}=S))"
            )

        long = {"timeout_s": 30, "compute_timeout_s": 30, "transfer_timeout_s": 30}
        kinds = {
            "timeout_s": [lambda c: c.stats(), lambda c: c.stat("abcdef12")],
            "compute_timeout_s": [
                lambda c: c.generate(token_ids=[1, 2, 3]),
                lambda c: c.deposit(token_ids=[1, 2, 3]),
                lambda c: c.verify("abcdef12"),
                lambda c: c.lookup([1, 2, 3]),
                lambda c: c.ask("What is 2 + 2?"),
            ],
            "transfer_timeout_s": [lambda c: c.scrub()],  # it had no deadline at all
        }
        for name, calls in kinds.items():
            with Client(address, **{**long, name: 0.2}) as client:
                for call in calls:
                    with pytest.raises(DeadlineExceeded) as caught:
                        call(client)
                    assert str(caught.value) == expired(name)
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="compute_timeout_s must be a number of seconds"):
            Client(NOWHERE, compute_timeout_s=bad)


def test_options_are_checked_like_python_arguments() -> None:
    with Client(NOWHERE) as client:  # each refused before any call is made
        with pytest.raises(TypeError) as caught:
            client.generate(token_ids=[1], temprature=0.5)
        assert str(caught.value) == (
            "generate_stream() got an unexpected keyword argument 'temprature' (its options: "
            "max_new_tokens, greedy, temperature, seed, no_cache, deposit, labels, "
            "return_logits, allow_untrusted, on_progress, top_p, top_k, stop, logprobs, "
            "top_logprobs, keep)"
        )
        with pytest.raises(
            TypeError, match=r"graft_stream\(\) got an unexpected keyword argument 'max_tokens'"
        ):
            client.graft("abcdef12", token_ids=[1], max_tokens=3)
        with pytest.raises(
            ValueError, match=r"greedy=True with temperature=0\.7: a temperature samples"
        ):
            client.generate(token_ids=[1], greedy=True, temperature=0.7)
        with pytest.raises(
            ValueError, match=r"greedy=False with temperature=0: a temperature of 0 is greedy"
        ):
            client.generate(token_ids=[1], greedy=False, temperature=0)
        with pytest.raises(ValueError, match="max_new_tokens must be 0 or more, not -3"):
            client.generate(token_ids=[1], max_new_tokens=-3)
        # Regression: 0 as the wire's float32, so the daemon sampled at 1.0
        for tiny in (1e-46, 5e-324):
            with pytest.raises(ValueError) as caught:
                client.generate(token_ids=[1], temperature=tiny)
            assert str(caught.value) == (
                f"temperature={tiny!r} is 0 on the wire (a float32): give 0 to decode "
                "greedily, or a temperature of 0.0001 or more to sample"
            )
        # Regression (issue 47): a top_p of 0 as a float32 was sent, and read as "every token"
        for tiny in (1e-300, 1e-46):
            with pytest.raises(ValueError, match=r"is 0 on the wire \(a float32\), which means"):
                client.generate(token_ids=[1], temperature=1, top_p=tiny)
    assert _generate_options("generate", None, {"temperature": 1, "top_p": 2.0**-149}).top_p > 0
    # the smallest the wire carries, and past its largest (inf), go to the daemon to judge
    assert _generate_options("generate", None, {"temperature": 1e-45}).temperature > 0
    assert _generate_options("generate", None, {"temperature": 1e300}).temperature == np.inf


@pytest.mark.parametrize(
    ("options", "sent"),
    [
        ({}, {}),  # greedy: the proto's default
        ({"temperature": 0}, {"greedy": True}),  # 0 is greedy, as in OpenAI's API
        ({"temperature": 0.7, "seed": 3}, {"greedy": False, "temperature": 0.7, "seed": 3}),
        ({"greedy": False}, {"greedy": False, "temperature": 1.0}),
        ({"greedy": False, "temperature": 2.0}, {"greedy": False, "temperature": 2.0}),
        ({"greedy": True, "temperature": 0}, {"greedy": True}),
        ({"greedy": True}, {"greedy": True}),
    ],
)
def test_a_temperature_samples_and_temperature_0_is_greedy(options: dict, sent: dict) -> None:
    """Regression: greedy=False with temperature 0 went out as temperature 0, which the
    daemon reads as 1.0; a temperature without greedy=False was ignored."""
    expected = pb.GenerateOptions(max_new_tokens=32, **sent)
    assert _generate_options("generate", None, options) == expected


def _receipt() -> pb.Receipt:
    return pb.Receipt(
        input_sha256=bytes(range(32)),
        prompt_logits_sha256=b"\x01" * 32,
        generated_logits_sha256=b"\xfe" * 32,
        generated_token_ids=[5, 6],
        reused_tokens=64,
        computed_tokens=9,
        model_fingerprint=b"\xcd" * 32,
        profile=pb.ComputeProfile(torch_version="2.13.0", attention="eager", page_tokens=64),
    )


def test_results_read_well_and_logits_are_arrays() -> None:
    vocab = 5
    prompt = np.arange(vocab, dtype="<f4")
    steps = np.arange(2 * vocab, dtype="<f4").reshape(2, vocab) / 7
    message = pb.GenerateResult(
        receipt=_receipt(),
        text="Orrun.",
        prompt_logits=prompt.tobytes(),
        generated_logits=[row.tobytes() for row in steps],
    )
    result = GenerateResult.from_proto(message)
    assert result.prompt_logits.dtype == np.float32 and result.prompt_logits.shape == (vocab,)
    assert result.generated_logits.shape == (2, vocab)
    assert np.array_equal(result.prompt_logits, prompt)
    assert np.array_equal(result.generated_logits, steps)
    # the arrays' bytes are the bytes the receipt's hashes are over
    assert (
        hashlib.sha256(result.generated_logits.tobytes()).digest()
        == hashlib.sha256(b"".join(message.generated_logits)).digest()
    )
    assert result.raw is message
    assert repr(result) == (
        "GenerateResult(text='Orrun.', token_ids=(5, 6), reused_tokens=64, computed_tokens=9, "
        "deposited_artifact_id='', prompt_logits=float32[5], generated_logits=float32[2, 5], "
        f"receipt={result.receipt!r})"
    )
    assert repr(result.receipt) == (
        "Receipt(reused_tokens=64, computed_tokens=9, generated_tokens=2, "
        f"input_sha256='{bytes(range(32)).hex()}', prompt_logits_sha256='{'01' * 32}', "
        f"generated_logits_sha256='{'fe' * 32}', model_fingerprint='{'cd' * 8}', "
        "grafted_artifact_id='')"
    )
    without = GenerateResult.from_proto(pb.GenerateResult(receipt=_receipt()))
    assert (without.prompt_logits, without.generated_logits) == (None, None)
    assert Receipt.from_proto(_receipt()) == result.receipt  # values: equal and hashable
    assert hash(Receipt.from_proto(_receipt())) == hash(result.receipt)


def test_ask_says_none_when_no_entry_matched() -> None:
    generated = AskResult.from_proto(pb.AskResponse(path=pb.ASK_PATH_GENERATE, entry_id=""))
    assert generated.matched_entry is None
    response = pb.AskResponse(path=pb.ASK_PATH_RECALL, entry_id="cd" * 32, receipt=_receipt())
    recalled = AskResult.from_proto(response)
    assert recalled.matched_entry == "cd" * 32
    assert "b'" not in repr(recalled) and "profile" not in repr(recalled)  # no bytes, no protobuf
    assert f"receipt={recalled.receipt!r}" in repr(recalled)


def test_the_client_documents_every_argument() -> None:
    documented = inspect.getdoc(Client)
    parameters = inspect.signature(Client).parameters
    assert [name for name in parameters if name not in documented] == []
