"""SpecPilot as an SGLang plugin: `--speculative-algorithm SPECPILOT` in `python -m sglang.launch_server`.

SGLang calls `plugin.register` through its entry-point group `sglang.srt.plugins` (pyproject.toml). `args`
resolves and checks SGLang's server arguments for our worker, `layout` turns our drafts (chains and trees)
into SGLang's verify inputs, `accept` turns SGLang's verify logits back into committed tokens by our
verifier's rule, `session` runs our DFlash drafter beside SGLang's target, `admission` names the requests it
cannot serve (refused as they arrive), and `worker` is the worker class SGLang's scheduler drives. `layout`,
`accept`, `session` and `admission` import nothing of SGLang's; the other modules run inside SGLang's process.
"""
