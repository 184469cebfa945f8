"""Bagua tensors: ``torch.Tensor`` gains the ``ensure_bagua_tensor`` family on import.

As in Bagua, a registered tensor is a *proxy*: its getter closure returns the *effective*
tensor that is communicated (``lambda p: p.grad`` for gradients, the weight itself by
default, ``lambda p: optimizer.state[p]["exp_avg"]`` for QAdam's momentum), so the
effective tensor may be replaced between steps while the proxy stays. A tensor registered
with a module name can be marked ready; its bucket's operations run when every tensor of
the bucket is ready.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["BaguaTensor", "install"]

Getter = Callable[[torch.Tensor], torch.Tensor]
Setter = Callable[[torch.Tensor, torch.Tensor], None]


class BaguaTensor:
    """The methods that :func:`install` adds to ``torch.Tensor`` (Bagua's ``BaguaTensor``)."""

    def is_bagua_tensor(self) -> bool:
        """True once :meth:`ensure_bagua_tensor` registered this tensor."""
        return hasattr(self, "_bagua_registered")

    def ensure_bagua_tensor(
        self,
        name: str | None = None,
        module_name: str | None = None,
        getter_closure: Getter | None = None,
        setter_closure: Setter | None = None,
    ) -> torch.Tensor:
        """Register this tensor (in place) as a Bagua tensor and return it.

        Args:
            name (str, optional): the tensor's unique name.
            module_name (str, optional): the model it belongs to (``model.bagua_module_name``);
                needed to mark it ready.
            getter_closure (Callable, optional): proxy -> effective tensor; identity if None.
            setter_closure (Callable, optional): (proxy, tensor) -> None, replaces the
                effective tensor; needs ``getter_closure``.

        Raises:
            ValueError: a ``setter_closure`` without ``getter_closure``, or a new name or
                module name for a tensor already registered under another one.
        """
        if setter_closure is not None and getter_closure is None:
            raise ValueError("ensure_bagua_tensor: setter_closure needs a getter_closure")
        if self.is_bagua_tensor() and name is not None:
            old = (self.bagua_tensor_name, self.bagua_module_name)  # type: ignore[attr-defined]
            if old != (name, module_name):
                raise ValueError(
                    f"ensure_bagua_tensor: tensor already registered as {old}; got "
                    f"name={name!r}, module_name={module_name!r}"
                )
        self.bagua_tensor_name = name if name is not None else ""  # type: ignore[attr-defined]
        self.bagua_module_name = module_name  # type: ignore[attr-defined]
        self._bagua_getter = getter_closure  # type: ignore[attr-defined]
        self._bagua_setter = setter_closure  # type: ignore[attr-defined]
        self._bagua_registered = True  # type: ignore[attr-defined]
        if not hasattr(self, "_bagua_bucket"):
            self._bagua_bucket = None  # type: ignore[attr-defined]
        return self  # type: ignore[return-value]

    def to_bagua_tensor(
        self,
        name: str | None = None,
        module_name: str | None = None,
        getter_closure: Getter | None = None,
        setter_closure: Setter | None = None,
    ) -> torch.Tensor:
        """A new Bagua tensor sharing this tensor's storage (see :meth:`ensure_bagua_tensor`)."""
        view = self.view(self.dtype)  # type: ignore[attr-defined]
        view._bagua_bucket = None
        return view.ensure_bagua_tensor(name, module_name, getter_closure, setter_closure)

    def bagua_getter_closure(self) -> torch.Tensor:
        """The effective tensor (what is communicated)."""
        getter = getattr(self, "_bagua_getter", None)
        return self if getter is None else getter(self)  # type: ignore[return-value]

    def bagua_setter_closure(self, tensor: torch.Tensor) -> None:
        """Make ``tensor`` the effective tensor.

        Raises:
            RuntimeError: the tensor was registered without a setter closure.
        """
        setter = getattr(self, "_bagua_setter", None)
        if setter is None:
            raise RuntimeError(f"tensor {getattr(self, 'bagua_tensor_name', '')!r} has no setter")
        setter(self, tensor)

    def bagua_backend_tensor(self) -> torch.Tensor:
        """The tensor the operations work on (the effective tensor)."""
        return self.bagua_getter_closure()

    def bagua_set_storage(self, storage: torch.UntypedStorage, storage_offset: int = 0) -> None:
        """Make the effective tensor a view of ``storage`` from ``storage_offset``.

        Its shape and dtype are kept; its values become those already in the storage.
        """
        effective = self.bagua_getter_closure()
        # Contiguous strides: set_ would keep a transposed tensor's, which would then read
        # its bucket slice in another order (and overlap itself while packing).
        strides = torch.empty(effective.shape, device="meta").stride()
        with torch.no_grad():
            effective.set_(storage, storage_offset, effective.shape, strides)

    def bagua_ensure_grad(self) -> torch.Tensor:
        """Give a parameter a zero gradient if it has none; return it.

        Raises:
            TypeError: a tensor that is not a parameter and has no gradient.
        """
        if getattr(self, "grad", None) is not None:
            return self  # type: ignore[return-value]
        if not isinstance(self, torch.nn.Parameter):
            raise TypeError("bagua_ensure_grad needs a torch.nn.Parameter")
        with torch.no_grad():
            self.grad = torch.zeros_like(self.data)
        return self

    def bagua_mark_communication_ready(self) -> None:
        """Mark this tensor ready; its bucket's operations start once all its tensors are.

        Raises:
            RuntimeError: the tensor has no module name, or its model is not wrapped.
        """
        from gossamer.bagua._state import state

        name = getattr(self, "bagua_module_name", None)
        model = state().models.get(name) if name is not None else None
        if model is None:
            raise RuntimeError(
                f"tensor {getattr(self, 'bagua_tensor_name', '')!r} belongs to no wrapped "
                f"model (module_name={name!r}); register it with the model's bagua_module_name"
            )
        model._bagua_backend.mark_communication_ready(self)

    def bagua_mark_communication_ready_without_synchronization(self) -> None:
        """:meth:`bagua_mark_communication_ready` (gossamer needs no CUDA event for it)."""
        self.bagua_mark_communication_ready()


def install() -> None:
    """Add :class:`BaguaTensor`'s methods to ``torch.Tensor`` (idempotent)."""
    for name, member in vars(BaguaTensor).items():
        if callable(member) and not name.startswith("__"):
            setattr(torch.Tensor, name, member)
