# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations


class ModuleDocFragment:
    """The attributes every module of the collection documents (as community.general's fragment does).

    A module extends C(gpuops.relaunch.attributes) (check_mode, diff_mode, platform), and sets each
    attribute's C(support) and C(details) (and the platform's C(platforms)) itself.
    """

    DOCUMENTATION = r"""
options: {}
attributes:
  check_mode:
    description: Can run in check mode (C(--check)) and return a prediction of C(changed) without changing the target.
  diff_mode:
    description: Returns details on what has changed (or would change in check mode) when run in diff mode (C(--diff)).
  platform:
    description: The systems the module can run on (the host it runs on, which is not always the target).
    support: N/A
"""

    # For a step of the relaunch role that an action plugin does on the controller alone; used with
    # DOCUMENTATION. A module that does more (a file, a module on the target) says so by
    # setting the attribute's description or details itself, which take precedence.
    CONTROLLER_STEP = r"""
options: {}
attributes:
  action:
    description: Runs on the controller as an action plugin; nothing runs on the target.
    support: full
  platform:
    platforms: all
    details:
      - The controller only; it needs no connection to the target.
seealso:
  - module: gpuops.relaunch.train_launch
notes:
  - A step of the C(gpuops.relaunch.relaunch) role; the decisions are plain functions in
    C(plugins/plugin_utils/relaunch_flow.py), unit-tested.
"""

    # For a module that never changes anything; used with DOCUMENTATION.
    INFO_MODULE = r"""
options: {}
attributes:
  check_mode:
    support: full
    details:
      - The module changes nothing, so check mode behaves as a normal run.
  diff_mode:
    support: N/A
    details:
      - The module changes nothing.
"""
