// The data socket's old header: DataServer (data_server.h) was ShmDataServer.
// Kept while callers move over; include data_server.h instead.
#ifndef WEIGHTD_SERVER_TRANSPORT_SHM_SERVER_H_
#define WEIGHTD_SERVER_TRANSPORT_SHM_SERVER_H_

#include "server/transport/data_server.h"

#endif  // WEIGHTD_SERVER_TRANSPORT_SHM_SERVER_H_
