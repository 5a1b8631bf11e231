"""Tasks: what a model's output means and how it is judged (``base.py`` says what a task owns). Each is a
registered kind (entry point group ``pruneflow.tasks``): ``classification``, ``binary``, ``regression``,
``segmentation``, ``embedding``, ``next_item`` and ``multi`` (named heads, each one of the others) are built in, a
third party's arrives the same way."""

from .base import COMMON_METRICS as COMMON_METRICS, Metric as Metric, MetricState as MetricState, Task as Task
from .base import ReadOutput as ReadOutput, make_task as make_task
from .classification import Classification as Classification, ClassificationConfig as ClassificationConfig
from .user import UserMetric as UserMetric, metric as metric, with_user_metrics as with_user_metrics
