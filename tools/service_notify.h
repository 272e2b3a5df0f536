// NotifyServiceManager: tells systemd how a Type=notify service is doing ("READY=1" once the
// mount answers, "STOPPING=1" when it goes), over the datagram socket that $NOTIFY_SOCKET names:
// the protocol of sd_notify(3), without linking libsystemd. Thread-safe.
#pragma once

#include <string_view>

namespace weightfs::cli {

// Sends `state` (newline-separated VAR=value lines). False if $NOTIFY_SOCKET is unset (not run
// by systemd, or not as Type=notify) or the message could not be sent.
bool NotifyServiceManager(std::string_view state);

}  // namespace weightfs::cli
