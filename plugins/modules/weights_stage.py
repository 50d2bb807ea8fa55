#!/usr/bin/python
"""Ansible module: stage a model's files (GGUF shards, safetensors snapshot) into a directory, verified against a manifest.

The staging itself is the collection's module_utils weights_stage (plugins/module_utils/weights_stage.py),
which Ansible ships to the host with this module and which `mlafleet weights stage` runs on the
controller.
"""

from __future__ import annotations

DOCUMENTATION = r"""
module: weights_stage
short_description: Stage GGUF shards or a safetensors snapshot verified against a sha256 manifest
description:
  - Fetches missing shards into C(.partial) files with resume, verifies their sha256, renames
    them atomically and stamps them so that re-runs cost one stat per shard.
  - Fails before the first byte when the filesystem lacks space for the remaining bytes, and
    fails at the end unless all N of N shards are present and verified.
  - The same code stages on the controller (C(mlafleet weights stage)).
  - With O(format=safetensors) and O(state=verified), also checks the snapshot before it is served
    (module_utils safetensors_check, headers only) - every tensor of C(model.safetensors.index.json)
    in a listed file, each file's header holding exactly the tensors the index assigns to it, and
    for a block-FP8 checkpoint every FP8 weight's C(<name>_scale_inv) of the shape its
    C(weight_block_size) implies - and fails naming the file and tensor.
version_added: 0.3.0
author: mlafleet maintainers (@mlafleet)
options:
  dest: {description: Directory that receives the shards., type: path, required: true}
  shards:
    description:
      - The manifest's files, each with C(name) (C(<model>-0000K-of-0000N.gguf) for GGUF, a plain file
        name for safetensors), C(size) and C(sha256), optionally C(chunk_size) and C(chunks) (the sha256
        of each chunk, for the spot check; without them, the first staging keeps them in the stamp).
    type: list
    elements: dict
    required: true
    aliases: [files]
  format:
    description: V(gguf) (shards 1..N of N of one model) or V(safetensors) (a snapshot directory's files).
    type: str
    choices: [gguf, safetensors]
    default: gguf
  sources:
    description: Sources tried in order for each shard.
    type: list
    elements: dict
    default: []
    suboptions:
      type:
        description: V(http) (a mirror, ranged requests), V(hub) (a model hub with a token), V(path) (a directory), V(peer) (rsync over SSH).
        type: str
        required: true
        choices: [http, hub, path, peer]
      url: {description: Base URL of the mirror (V(http)); the shard name is appended., type: str}
      path:
        description: Directory holding the shards (V(path)); the peer's shard directory (V(peer), empty when its key restricts the login to it).
        type: str
      endpoint: {description: The hub's base URL (V(hub)); default https://huggingface.co., type: str}
      repo: {description: The hub repository (V(hub)) such as C(org/model-GGUF)., type: str}
      revision: {description: The hub commit (V(hub)), 40 hex digits; a branch or tag name is refused., type: str}
      token: {description: Bearer token for the hub (V(hub)); never shown in output., type: str}
      host: {description: Address of the peer (V(peer))., type: str}
      user: {description: SSH user on the peer (V(peer)); default C(root)., type: str}
      port: {description: SSH port of the peer (V(peer)); default 22., type: int}
      ssh_key: {description: Private key for the peer (V(peer))., type: str}
      known_hosts: {description: Known hosts file that holds the peer's host key (V(peer))., type: str}
      rsh:
        description: The whole remote shell command for rsync (V(peer)), instead of one built from the options above.
        type: str
  state:
    description: V(staged) fetches what is missing; V(verified) only proves that all shards are present.
    type: str
    choices: [staged, verified]
    default: staged
  verify:
    description: V(stamp) trusts matching stamps (plus the spot check); V(full) re-hashes every shard.
    type: str
    choices: [stamp, full]
    default: stamp
  spot_chunks:
    description:
      - With O(verify=stamp), chunks per stamped shard read and checked against the manifest's
        per-chunk sha256 on every run, picked at random (all of them when a shard has fewer).
        0 turns the spot check off; shards without chunk hashes in the manifest are not spot-checked.
    type: int
    default: 2
  retries: {description: Extra attempts per source and shard after a failed or corrupt download., type: int, default: 2}
  reserve_mb: {description: Free space to keep on the filesystem beyond the shards., type: int, default: 1024}
  timeout: {description: Network timeout in seconds., type: int, default: 60}
attributes:
  check_mode:
    support: full
    description: Plans what would be fetched (and how many bytes) without writing.
notes:
  - The role mlafleet.fleet.weights builds O(shards) from a manifest (C(mlafleet weights manifest))
    and O(sources) from its variables, with peer fan-out between hosts.
"""

EXAMPLES = r"""
- name: Stage a model's shards from a mirror
  mlafleet.fleet.weights_stage:
    dest: /var/lib/mlafleet/models/GLM-5-Q4_K_M
    shards: "{{ (lookup('ansible.builtin.file', 'GLM-5-Q4_K_M.manifest.json') | from_json).shards }}"
    sources:
      - type: http
        url: https://mirror.example.com/GLM-5-Q4_K_M/

- name: Prove that all shards are present (reads nothing but stamps and a few chunks)
  mlafleet.fleet.weights_stage:
    dest: /var/lib/mlafleet/models/GLM-5-Q4_K_M
    shards: "{{ (lookup('ansible.builtin.file', 'GLM-5-Q4_K_M.manifest.json') | from_json).shards }}"
    state: verified
"""

RETURN = r"""
present:
  description: Shards present and verified.
  type: int
  returned: always
  sample: 8
expected:
  description: Shards the manifest lists.
  type: int
  returned: always
  sample: 8
fetched:
  description: Shards that were (or in check mode would be) fetched.
  type: list
  elements: str
  returned: O(state=staged)
ready:
  description: Shards already verified and stamped.
  type: list
  elements: str
  returned: O(state=staged)
restamped:
  description: Shards intact on disk whose stamp was missing or stale.
  type: list
  elements: str
  returned: O(state=staged)
corrupt:
  description: Shards on disk that did not match the manifest and were replaced.
  type: list
  elements: str
  returned: O(state=staged)
bytes_to_fetch:
  description: Bytes still to come when the run started.
  type: int
  returned: O(state=staged)
sources_used:
  description: Per fetched shard, the source that delivered it.
  type: dict
  returned: O(state=staged)
  sample: {GLM-5-Q4_K_M-00001-of-00008.gguf: "peer:10.0.0.11"}
corrupt_downloads:
  description: Downloads thrown away because their sha256 did not match.
  type: int
  returned: O(state=staged), when not in check mode
unstamped:
  description: Shards intact on disk without a matching stamp.
  type: list
  elements: str
  returned: O(state=verified)
snapshot:
  description: >-
    O(format=safetensors), O(state=verified) - the checks before serving - safetensors_files, tensors,
    fp8_weights, weight_block_size and a summary line.
  type: dict
  returned: O(format=safetensors) and O(state=verified)
spot_check:
  description: >-
    What the spot check read (shards, chunks, bytes, seconds), the shards it could not check, those that failed
    (failed) with the chunk that did not match (corrupt, a list of shard and chunk), and a summary line for people.
  type: dict
  returned: always
log:
  description: Progress messages (tokens redacted).
  type: list
  elements: str
  returned: O(state=staged)
"""

from ansible_collections.mlafleet.fleet.plugins.module_utils.safetensors_check import CheckError, check_snapshot
from ansible_collections.mlafleet.fleet.plugins.module_utils.weights_stage import (
    StageError, make_source, parse_files, parse_shards, prove_present, redact, stage)


def main() -> None:
    from ansible.module_utils.basic import AnsibleModule

    source_spec = {
        "type": {"type": "str", "required": True, "choices": ["http", "hub", "path", "peer"]},
        "url": {"type": "str"}, "path": {"type": "str"}, "endpoint": {"type": "str"},
        "repo": {"type": "str"}, "revision": {"type": "str"}, "token": {"type": "str", "no_log": True},
        "host": {"type": "str"}, "user": {"type": "str"}, "port": {"type": "int"},
        "ssh_key": {"type": "str", "no_log": False}, "known_hosts": {"type": "str"}, "rsh": {"type": "str"},
    }
    module = AnsibleModule(
        argument_spec={
            "dest": {"type": "path", "required": True},
            "shards": {"type": "list", "elements": "dict", "required": True, "aliases": ["files"]},
            "format": {"type": "str", "default": "gguf", "choices": ["gguf", "safetensors"]},
            "sources": {"type": "list", "elements": "dict", "default": [], "options": source_spec},
            "state": {"type": "str", "default": "staged", "choices": ["staged", "verified"]},
            "verify": {"type": "str", "default": "stamp", "choices": ["stamp", "full"]},
            "spot_chunks": {"type": "int", "default": 2},
            "retries": {"type": "int", "default": 2},
            "reserve_mb": {"type": "int", "default": 1024},
            "timeout": {"type": "int", "default": 60},
        },
        supports_check_mode=True,
    )
    params = module.params
    secrets = [s.get("token") or "" for s in params["sources"]]
    messages: list[str] = []
    try:
        snapshot = params["format"] == "safetensors"
        shards = parse_files(params["shards"]) if snapshot else parse_shards(params["shards"])
        if params["state"] == "verified":
            proof = prove_present(params["dest"], shards, params["verify"], params["spot_chunks"])
            if snapshot:
                proof["snapshot"] = check_snapshot(params["dest"], [s.name for s in shards])
            module.exit_json(**proof)
        sources = [make_source(spec, params["timeout"]) for spec in params["sources"]]
        result = stage(params["dest"], shards, sources, verify=params["verify"], retries=params["retries"],
                       reserve=params["reserve_mb"] << 20, check_mode=module.check_mode, log=messages.append,
                       spot_chunks=params["spot_chunks"])
    except (StageError, CheckError) as err:
        module.fail_json(msg=redact(str(err), secrets), log=[redact(m, secrets) for m in messages])
    module.exit_json(log=[redact(m, secrets) for m in messages], **result)


if __name__ == "__main__":
    main()
