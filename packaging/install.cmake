# Run by `cmake --install` after the binary is installed (install(SCRIPT) in CMakeLists.txt), with
# the prefix chosen then (CMAKE_INSTALL_PREFIX) and DESTDIR from the environment. Every file it
# makes is listed in the install manifest, so that `xargs rm < install_manifest.txt` removes it.
#
#   mount.fuse.weightfs, umount.fuse.weightfs  symbolic links to BINDIR/weightfs, where mount(8)
#       looks for helpers (libmount searches /sbin, /sbin/fs.d, /sbin/fs): /sbin for the system
#       prefixes /usr and /usr/local (/usr/sbin where /sbin links there, as on Debian 12), else
#       PREFIX/sbin (link them into /sbin by hand);
#   weightfs@.service  the systemd service template, in PREFIX/lib/systemd/system (systemd reads
#       /usr/lib/... and /usr/local/lib/...), naming BINDIR/weightfs.

set(_prefix "${CMAKE_INSTALL_PREFIX}")
string(REGEX REPLACE "/+$" "" _prefix "${_prefix}")
if(IS_ABSOLUTE "${WEIGHTFS_BINDIR}")
  set(_bindir "${WEIGHTFS_BINDIR}")
else()
  set(_bindir "${_prefix}/${WEIGHTFS_BINDIR}")
endif()
if(IS_ABSOLUTE "${WEIGHTFS_DOCDIR}")
  set(_docdir "${WEIGHTFS_DOCDIR}")
else()
  set(_docdir "${_prefix}/${WEIGHTFS_DOCDIR}")
endif()
if(_prefix STREQUAL "/usr" OR _prefix STREQUAL "/usr/local")
  if(IS_SYMLINK "/sbin")
    set(_sbindir "/usr/sbin")
  else()
    set(_sbindir "/sbin")
  endif()
else()
  set(_sbindir "${_prefix}/sbin")
endif()

function(_weightfs_installed path)
  message(STATUS "Installing: ${path}")
  list(APPEND CMAKE_INSTALL_MANIFEST_FILES "${path}")
  set(CMAKE_INSTALL_MANIFEST_FILES "${CMAKE_INSTALL_MANIFEST_FILES}" PARENT_SCOPE)
endfunction()

file(MAKE_DIRECTORY "$ENV{DESTDIR}${_sbindir}")
foreach(_helper mount.fuse.weightfs umount.fuse.weightfs)
  set(_link "$ENV{DESTDIR}${_sbindir}/${_helper}")
  file(REMOVE "${_link}")
  file(CREATE_LINK "${_bindir}/weightfs" "${_link}" SYMBOLIC)
  _weightfs_installed("${_link}")
endforeach()

set(BINDIR "${_bindir}")
set(DOCDIR "${_docdir}")
set(_unit "$ENV{DESTDIR}${_prefix}/lib/systemd/system/weightfs@.service")
configure_file("${WEIGHTFS_PACKAGING_DIR}/systemd/weightfs@.service.in" "${_unit}" @ONLY)
_weightfs_installed("${_unit}")
