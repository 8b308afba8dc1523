"""What a recipe says and which machine runs it: the schema and its sections (``schema``, ``sections``, ``kinds``,
``storage_config``, ``modules_config``, ``detectors``), bounded YAML (``safe_yaml``), reading files and ``extends:``
(``files``), the hardware table and ``auto`` (``hardware``, ``loader``), the ``modules:`` rules matched to a model
(``module_rules``), and the shipped recipes themselves (``builtin/*.yaml``).

May import: ``core``, ``scaling``.
"""
