"""Drive NeMo Gym 0.7's own ``vllm_model`` server code against a running rollout-service.

Run by tests/test_serve_required_prefix.py in a process of its own, with ``PYTHONPATH`` set to the
directory scripts/setup_test_clients.sh installs nemo-gym 0.7 into, its ``pins`` first (ahead of the venv's
packages: Gym runs on the openai version it pins), and Gym's own environment: ``NEMO_GYM_CONFIG_DICT`` (the global config a
Gym-launched server process gets from its parent: training-token capture into a directory, whose
file sink and lineage store resolve each call's parent and so decide the prefix) and
``NEMO_GYM_VLLM_TRANSPORT_LOG`` (Gym's record of every request it sends and answer it gets).

For each dialect of Gym's server (its ``/v1/chat/completions``, and its ``/v1/responses``, which
converts to chat), one rollout of ``turns`` calls goes through Gym's app exactly as a Gym agent's
calls do (``/ng-rollout/<id>/training-token-capture/v1/...``), each call continuing the history with
the answer and a new user message. Prints JSON: per dialect, the HTTP status and body of each call
and the (prefix_requested, prefix_supplied) flags of Gym's captured token entries.

    python tests/nemo_gym_driver.py BASE_URL MODEL TURNS
"""

from __future__ import annotations

import json
import os
import sys
import uuid


def main(base_url: str, model_name: str, turns: int) -> dict:
    from fastapi.testclient import TestClient
    from omegaconf import OmegaConf

    from nemo_gym.server_utils import BaseServerConfig, ServerClient
    from nemo_gym.token_id_capture import TokenCaptureStore
    from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig

    conf = json.loads(os.environ["NEMO_GYM_CONFIG_DICT"])
    config = VLLMModelConfig(
        host="127.0.0.1", port=0, entrypoint="app.py", name="policy_model", base_url=base_url, api_key="unused",
        model=model_name, return_token_id_information=True, uses_reasoning_parser=True, supply_prefix_token_ids=True)
    client = ServerClient(head_server_config=BaseServerConfig(host="127.0.0.1", port=1),
                          global_config_dict=OmegaConf.create(conf))
    model = VLLMModel(config=config, server_client=client)
    store = TokenCaptureStore(conf["token_id_capture"]["dir"])
    out: dict = {}
    with TestClient(model.setup_webserver()) as app:
        for dialect in ("chat", "responses"):
            rollout = f"gym-{dialect}-{uuid.uuid4().hex[:6]}"
            history: list[dict] = [{"role": "user", "content": "Name a colour."}]
            answers = []
            for turn in range(turns):
                if dialect == "chat":
                    path, body = "chat/completions", {"messages": history, "max_tokens": 6, "seed": 11 + turn,
                                                      "temperature": 1.0}
                else:  # thinking off: the random model never closes </think>, and a reasoning-only answer has no
                    # assistant message, which is what Gym's lineage recognises a parent by (no parent, no prefix)
                    path, body = "responses", {"input": history, "max_output_tokens": 6, "temperature": 1.0,
                                               "metadata": {"chat_template_kwargs": json.dumps({"enable_thinking": False})}}
                r = app.post(f"/ng-rollout/{rollout}/training-token-capture/v1/{path}", json=body)
                answers.append({"status": r.status_code, "body": r.text})
                if r.status_code != 200:
                    break
                if dialect == "chat":
                    history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
                else:
                    history.extend(r.json()["output"])
                history.append({"role": "user", "content": f"Another one ({turn})."})
            out[dialect] = {"answers": answers, "entries": [
                [e.prefix_requested, e.prefix_supplied] for e in store.read_entries(rollout)]}
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
