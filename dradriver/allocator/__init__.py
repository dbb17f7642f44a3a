"""The allocation simulator behind ``dradriver allocate`` and ``explain`` and the sandbox's scheduler: it reads
Kubernetes objects, allocates DRA claims as kube-scheduler does, and explains the outcome in the user's terms.

:mod:`.simulation` (read the objects, allocate, explain) drives :mod:`.allocation` (kube-scheduler's structured
allocator, one node at a time) over the typed views of :mod:`.resources` (converted to v1 by :mod:`.conversion`).
Selectors are CEL with the Kubernetes environment (:mod:`.expression`, :mod:`.semver`), evaluated once per device
shape (:mod:`.shapes`), explained in words (:mod:`.wording`, :mod:`.diagnosis`). Around them: consumable capacity
(:mod:`.capacity`, KEP-5075), DRA-backed extended resources (:mod:`.extended`, KEP-5004), node CPU and memory
with KEP-5517 overhead (:mod:`.noderesources`), workloads and ComputeDomains expanded into the Pods and claims
their controllers would create (:mod:`.workloads`, :mod:`.computedomains`, :mod:`.naming`), resource quantities
(:mod:`.quantity`) and the documents refused with what to use instead (:mod:`.refusals`).
"""
