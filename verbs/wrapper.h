/* The ibverbs API surface rixl-verbs binds. Static inline helpers (ibv_post_send, ibv_poll_cq,
 * ibv_req_notify_cq, ___ibv_query_port, ...) are wrapped into real symbols by bindgen's
 * wrap_static_fns and compiled with the cc crate. */
#include <infiniband/verbs.h>
