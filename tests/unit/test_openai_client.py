"""The server (runtime.inference.server) through the official `openai` client, as an application would use it:
completions, chat completions plain and streamed, the model list, and the client's exceptions for a bad request,
an unknown model and a wrong API key. The worker is test_inference_server's deterministic fake."""

import pytest

from tests.unit.test_inference_server import MODEL, Server, expected_text

openai = pytest.importorskip("openai")

KEY = "test-key"


@pytest.fixture(scope="module")
def server():
    s = Server(api_key=KEY)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    # no retries: a 429 or 5xx is the answer under test, not something to wait out
    with openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, max_retries=0,
                       timeout=20) as c:
        yield c


def test_completion(client):
    answer = client.completions.create(model=MODEL, prompt="hello there", max_tokens=5, temperature=0, seed=3)
    assert answer.object == "text_completion" and answer.model == MODEL
    assert answer.choices[0].text == expected_text("hello there", 5)
    assert answer.choices[0].finish_reason == "length"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == (11, 5, 16)


def test_streamed_completion_with_a_stop_string(client):
    text = expected_text("abc", 10)
    chunks = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=10, stop=[text[5:7]],
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text[:5]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_completion(client):
    prompt = "system: Be brief.\nuser: Hi\nassistant: "  # the byte tokenizer's plain chat template
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                                                   {"role": "user", "content": "Hi"}],
                                            max_completion_tokens=6)
    assert answer.object == "chat.completion"
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == expected_text(prompt, 6)
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 6


def test_streamed_chat_completion(client):
    prompt = "user: Hi\nassistant: "
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=7,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected_text(prompt, 7)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7


def test_models_list(client):
    models = list(client.models.list())
    assert [m.id for m in models] == [MODEL] and models[0].owned_by == "zplan"


def test_a_bad_request_raises_the_clients_status_error(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="hi", temperature=50)
    assert isinstance(refused.value, openai.APIStatusError) and refused.value.status_code == 400
    assert refused.value.body["param"] == "temperature"
    assert "0 <= temperature <= 10" in refused.value.body["message"]
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}])
    assert unknown.value.body["code"] == "model_not_found"


def test_a_wrong_api_key_raises_authentication_error(server):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError) as refused:
            c.models.list()
    assert refused.value.status_code == 401
