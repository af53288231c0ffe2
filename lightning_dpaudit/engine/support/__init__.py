"""Small tools the engine's parts share: tensors' names, a method patched on one object, warnings at user code."""
