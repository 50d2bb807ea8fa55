#!/usr/bin/python
"""Ansible module: merge a model's verified GGUF shards into one GGUF file, streamed.

The merge itself is the collection's module_utils gguf_merge (plugins/module_utils/gguf_merge.py),
which Ansible ships to the host with this module and which `mlafleet weights merge` runs on the
controller.
"""

from __future__ import annotations

DOCUMENTATION = r"""
module: gguf_weights_merge
short_description: Stream verified GGUF shards into one GGUF file
description:
  - For vLLM versions that load a single GGUF file only. The merged file carries the first
    shard's metadata without the C(split.*) keys and every shard's tensors, copied in order
    chunk by chunk (never a whole file in memory), through C(<output>.partial) and a rename.
  - A stamp beside the output (size, mtime, inputs) makes a re-run with the same shards a no-op.
  - Fails before writing when the filesystem lacks space for the merged file.
version_added: 0.3.0
author: mlafleet maintainers (@mlafleet)
options:
  dest: {description: Directory holding the shards., type: path, required: true}
  shards: {description: Shard file names in order., type: list, elements: str, required: true}
  output:
    description: The merged file; must not be named like a shard (vLLM would look for its siblings).
    type: path
    required: true
attributes:
  check_mode:
    support: full
    description: Reports whether the merged file would be written.
notes:
  - Stage and verify the shards first (M(mlafleet.fleet.weights_stage)); the role
    mlafleet.fleet.weights does both with O(output) under the model's directory.
"""

EXAMPLES = r"""
- name: Merge a model's two verified shards into one file
  mlafleet.fleet.gguf_weights_merge:
    dest: /var/lib/mlafleet/models/GLM-5-Q4_K_M
    shards:
      - GLM-5-Q4_K_M-00001-of-00002.gguf
      - GLM-5-Q4_K_M-00002-of-00002.gguf
    output: /var/lib/mlafleet/models/GLM-5-Q4_K_M/GLM-5-Q4_K_M.gguf
"""

RETURN = r"""
output:
  description: Path of the merged file.
  type: str
  returned: always
  sample: /var/lib/mlafleet/models/GLM-5-Q4_K_M/GLM-5-Q4_K_M.gguf
size:
  description: Size of the merged file in bytes.
  type: int
  returned: when every shard is present
tensors:
  description: Number of tensors in the merged file.
  type: int
  returned: when every shard is present
sha256:
  description: sha256 of the merged file, computed while writing it.
  type: str
  returned: when the file was written
missing:
  description: Shards not present yet (in check mode only, as staging would bring them).
  type: list
  elements: str
  returned: in check mode, when shards are missing
"""

from ansible_collections.mlafleet.fleet.plugins.module_utils.gguf_merge import MergeError, merge


def main() -> None:
    from ansible.module_utils.basic import AnsibleModule

    module = AnsibleModule(
        argument_spec={
            "dest": {"type": "path", "required": True},
            "shards": {"type": "list", "elements": "str", "required": True},
            "output": {"type": "path", "required": True},
        },
        supports_check_mode=True,
    )
    try:
        result = merge(module.params["dest"], module.params["shards"], module.params["output"], module.check_mode)
    except MergeError as err:
        module.fail_json(msg=str(err))
    module.exit_json(**result)


if __name__ == "__main__":
    main()
