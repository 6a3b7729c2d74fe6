from kvgraft import Client


def test_put_get(client: Client, rng) -> None:
    from tests.support.factory import random_artifact

    artifact = random_artifact(rng)
    response = client.put_artifact(artifact)
    assert response.artifact_id == artifact.id
    fetched = client.get_artifact(artifact.id)
    assert {d: bytes(v) for d, v in fetched.pages.items()} == {
        d: bytes(v) for d, v in artifact.pages.items()
    }
